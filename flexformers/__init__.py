"""flexformers: IOT, MAT, InDIGO and the Depth-Adaptive Transformer as Hugging Face Transformers models.

`import flexformers` registers every model type with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM`.
The installed import names all live under this package (the repository's top-level folders are mapped into it
by setup.cfg's ``package_dir``): ``flexformers.configuration``, ``flexformers.modeling``,
``flexformers.training_scripts``, ``flexformers.metrics``.
"""

import os as _os

# In a source checkout this folder holds only this file, and setup.cfg's package_dir maps the repository's top-level
# folders into the package. Imported from the checkout's root (`python -m flexformers.training_scripts.train` there,
# with the package installed or not), the subpackages are found in those folders, as an installed tree has them here.
if not _os.path.isdir(_os.path.join(__path__[0], "configuration")):
    _checkout = _os.path.dirname(_os.path.abspath(__path__[0]))
    if _os.path.isfile(_os.path.join(_checkout, "setup.cfg")) and _checkout not in __path__:
        __path__.append(_checkout)

from . import configuration, modeling  # noqa: E402
from .configuration import *  # noqa: F401,F403
from .modeling import *  # noqa: F401,F403

__version__ = "0.1.0"
__all__ = sorted(set(configuration.__all__) | set(modeling.__all__))
