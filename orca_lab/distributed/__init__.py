"""ORCA's distributed execution (§4.1): worker processes, the control plane (messages, wire format,
sockets, heartbeat), the tensor data plane, and the executor that drives them."""
