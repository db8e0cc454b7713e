"""Local ``evaluate`` metric modules (load offline with ``evaluate.load(<this dir>/<name>)``).

``evaluate.load("sacrebleu")`` downloads its script from the Hub; these directories ship the same computations
(through the installed ``sacrebleu``) so evaluation works offline. Use
:func:`flexformers.training_scripts.metrics_utils.load_metric` to load them by name.
"""
