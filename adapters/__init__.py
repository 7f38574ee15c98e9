"""Built-in backends. Imported lazily by name through ``spec_tot.backends``."""
