"""KV pool, page allocator, encoder cache (and later GDN and prefix caches)."""
