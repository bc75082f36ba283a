"""hkvsim: KV-cache and SSM-state transfer testbed for P/D disaggregation."""

__version__ = "0.1.0"
