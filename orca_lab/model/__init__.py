"""The selective-batching GPT and what runs it on one device: sampling, tensor-parallel layers, CUDA
graphs, K/V sizing, and the in-process executor."""
