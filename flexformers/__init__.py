"""flexformers: IOT, MAT, InDIGO and the Depth-Adaptive Transformer as Hugging Face Transformers models.

`import flexformers` registers every model type with `AutoConfig`, `AutoModel` and `AutoModelForSeq2SeqLM`.
The installed import names all live under this package (the repository's top-level folders are mapped into it
by setup.cfg's ``package_dir``): ``flexformers.configuration``, ``flexformers.modeling``,
``flexformers.training_scripts``, ``flexformers.metrics``.
"""

from . import configuration, modeling
from .configuration import *  # noqa: F401,F403
from .modeling import *  # noqa: F401,F403

__version__ = "0.1.0"
__all__ = sorted(set(configuration.__all__) | set(modeling.__all__))
