"""The model: the transformer (modules, layer program, functional API), its parameters (HF
safetensors, orbax) and the one loader."""
