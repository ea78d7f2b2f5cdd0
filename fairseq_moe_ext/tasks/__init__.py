from . import nllb_multilingual  # noqa: F401  (registers translation_multi_simple_epoch_nllb)
