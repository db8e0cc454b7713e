"""One module per model type, each defining ``SPEC = MethodSpec(...)``.

See :mod:`flexformers.training_scripts.model_registry` for the contract. Modules are imported lazily by
:func:`flexformers.training_scripts.model_registry.get_method_spec`, so a broken or slow method never affects another.
"""
