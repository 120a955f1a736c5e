"""Drafter training (``eyas train``): EAGLE-3 with training-time test and MTP layers for a target that has
none, from hidden-state dumps or online, exported to the public layouts.

``attention``: TTT attention; ``data``/``online``: batches; ``vocab``: the draft vocabulary;
``objective``: targets and loss; ``recipes``: drafters and the unroll; ``trainer``: the loop and
checkpoints; ``export``/``evaluate``: the folder, model card and engine measurement; ``command``:
the command line. The engine never imports this package.
"""
