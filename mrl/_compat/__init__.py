"""Optional heavy dependencies, each try-imported in exactly one module here."""
