"""Memory: one ``MemoryBreakdown`` type, obtained three ways (analytic, exact trace, measured)."""
