"""KV pool and page allocator, GDN state pool and snapshots, prefix cache, encoder cache."""
