"""DreamBooth on Ray: the library behind the scripts at the repository root.

Flat inside, one module per concern; docs/ARCHITECTURE.md says where each behaviour lives.
Scripts import this package, never the other way.
"""
