"""Hugging Face NLLB-MoE out and in (``fairseq-moe export-hf|import-hf``).

Modules:
    config.py           our options <-> NllbMoeConfig (config.json), from the option records' HF names
    fields.py           the config.json fields checked first: model_type and architectures, the numbers
    routing.py          the second-expert policy, normalisation order and evaluation capacity, both ways
    keys.py             tensor names: ours <-> NllbMoe's, experts included
    dtype.py            the precision of what is written (--dtype), and its checks
    exporter.py         export-hf: a set out as safetensors shards, one output file in memory at a time
    importer.py         import-hf: an NllbMoe directory in as this project's set (checked, then its reader
                        HfShards into the set writer, set_writer.write_shards)
    reader.py           HfShards: one output rank file at a time, each tensor read straight into it
    safetensors_file.py the safetensors format, written and read with torch alone
    torch_bin_file.py   HF ``pytorch_model*.bin`` shards (the hub's NLLB-MoE), each tensor read by seeking
"""
