"""Example plug-ins, one per extension point: ``examples/plugins/<module>.py:<function>``, or
``plugins.<module>.<function>`` with ``PYTHONPATH=examples``."""
