"""fairseq's moe/``nllb`` branch sets in (``fairseq-moe import-fairseq-moe``).

Modules:
    reader.py        BranchSet: the branch's files (plain, consolidated or FSDP-sharded), read once each
    options.py       the branch's options -> this project's flags, with a NOTE for what is not mapped
    importer.py      import-fairseq-moe: the set written for W workers (the reader BranchShards into the set
                     writer, set_writer.write_shards)
    vocab.py         --dictionary / --langs checked against the embedding
    consolidated.py  the consolidated and flat layouts: which files, and the one-line refusals
    fsdp_shards.py   joining fairscale FSDP ``-shard`` files into consolidated dicts
    same_run.py      every file is of one save and one run
"""
