"""KV cache managers: who owns which cache memory, and the graph inputs that describe it."""
