"""Training, data, tokenizer and evaluation tooling for flexformers (not needed to *use* a trained model).

Entry points: ``training_scripts.train`` (``flexformers-train``), ``training_scripts.decode``
(``flexformers-decode``) and ``training_scripts.quickstart`` (``flexformers-quickstart``, the README main job).
Every model type plugs in through ``training_scripts/methods/<model_type>.py``; see
:mod:`training_scripts.model_registry` for the contract.
"""
