"""A plugin whose import fails, as one needing a missing native library would."""
raise ImportError("libfakedev.so: cannot open shared object file")
