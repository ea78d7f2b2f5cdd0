"""fairseq-moe-ext: Mixture-of-Experts for stock fairseq, loaded with ``--user-dir``.

Importing the package (fairseq does it for ``--user-dir``) registers the MoE architectures and
criterions and installs the few fixes to fairseq behaviour kept in ``fairseq_integration``.
The MoE math lives in ``fairseq_moe_ext.moe`` and imports torch only.
"""

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

try:
    import fairseq  # noqa: F401
except ImportError:  # the MoE core stays usable without fairseq
    fairseq = None

if fairseq is not None:
    from . import fairseq_integration

    fairseq_integration.install()
    from . import criterions, models  # noqa: F401,E402
