"""Training, data, tokenizer and evaluation tooling for flexformers (not needed to *use* a trained model).

Entry points: ``flexformers.training_scripts.train`` (``flexformers-train``), ``flexformers.training_scripts.decode``
(``flexformers-decode``) and ``flexformers.training_scripts.quickstart`` (``flexformers-quickstart``, the README main job).
Every model type plugs in through ``training_scripts/methods/<model_type>.py``; see
:mod:`flexformers.training_scripts.model_registry` for the contract.
"""
