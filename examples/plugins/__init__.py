"""Example plug-ins, one per extension point (``PYTHONPATH=examples``, then ``plugins.<module>.<function>``)."""
