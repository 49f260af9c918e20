"""Fault families: one folder each (``tc/``, ``proxy/``, ``gpu/``), each declaring itself once
as ``FAMILY`` in its ``__init__``. ``contract`` is all the runner knows of them; ``catalog``
finds them. See CREATING_FAULTS.md."""
