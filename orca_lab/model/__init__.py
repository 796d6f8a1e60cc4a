"""The selective-batching models (GPT-2 in ``gpt.py``, the Llama family in ``llama.py``, chosen by
``families.py``) and what runs them on one device: sampling, tensor-parallel layers, CUDA graphs,
K/V sizing, and the in-process executor."""
