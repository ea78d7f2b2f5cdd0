"""``translation_multi_simple_epoch_nllb``: stock fairseq's multilingual task with NLLB's dictionary.

The ``nllb`` branch's multilingual data manager (``fairseq/data/multilingual/multilingual_utils.py``
there, ``augment_dictionary``) appends, with ``--add-data-source-prefix-tags``, three data-source
tags after the language tokens: ``<MINED_DATA>``, ``<MMT_BT_DATA>``, ``<SMT_BT_DATA>``, in that
order. NLLB-200's models were trained with them, so their embeddings have three rows more than stock
fairseq 0.12's ``translation_multi_simple_epoch`` builds a dictionary for: without the tags the model
does not load, or, where the sizes happen to match, every token after the language tokens is another
token. This task is the stock one with that flag; the tags are only symbols here (the branch also
prefixed training data from mined or back-translated corpora with them, which fine-tuning on one's
own bitext does not do).
"""

from fairseq.data.multilingual.multilingual_data_manager import MultilingualDatasetManager
from fairseq.tasks import register_task
from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

from ..common.config_value import config_value

# The nllb branch's DATA_SOURCE_PREFIX_TAGS, in its order (a dict: insertion order is the order added).
DATA_SOURCE_PREFIX_TAGS = ("<MINED_DATA>", "<MMT_BT_DATA>", "<SMT_BT_DATA>")


@register_task("translation_multi_simple_epoch_nllb")
class NllbTranslationMultiSimpleEpochTask(TranslationMultiSimpleEpochTask):
    """``translation_multi_simple_epoch`` plus ``--add-data-source-prefix-tags`` (NLLB-200's dictionary)."""

    @staticmethod
    def add_args(parser):
        TranslationMultiSimpleEpochTask.add_args(parser)
        parser.add_argument(
            "--add-data-source-prefix-tags",
            default=False,
            action="store_true",
            help="append NLLB's data-source tags <MINED_DATA> <MMT_BT_DATA> <SMT_BT_DATA> to the "
            "dictionary after the language tokens, as the nllb branch did (NLLB-200 models)",
        )

    @classmethod
    def setup_task(cls, args, **kwargs):
        langs, dicts, training = MultilingualDatasetManager.prepare(cls.load_dictionary, args, **kwargs)
        if config_value(args, "add_data_source_prefix_tags", False):
            # After prepare: it has appended the language tokens (and <mask> where the style asks for it).
            for dictionary in {id(d): d for d in dicts.values()}.values():
                for tag in DATA_SOURCE_PREFIX_TAGS:
                    dictionary.add_symbol(tag)
        return cls(args, langs, dicts, training)
