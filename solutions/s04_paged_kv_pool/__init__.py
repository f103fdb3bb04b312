"""Stage 4: the paged KV pool - one preallocated pool of K/V slots shared by every request, an
allocator that hands slots out in pages, a request -> slots table, and attention that reads
each request's K/V through that table."""
