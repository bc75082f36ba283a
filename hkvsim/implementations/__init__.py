"""Connector implementations other than hkvsim's own core (hkvsim/connector), run on hkvsim's
fabric and checked by its oracle. Each subpackage imports its implementation lazily."""
