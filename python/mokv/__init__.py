"""mokv: KV-cache managers, graph types and Mojo kernels for Modular MAX."""
