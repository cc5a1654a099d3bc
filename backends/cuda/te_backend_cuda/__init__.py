"""te-core's NVIDIA backend. The registry loads `te_backend_cuda.plugin` through the
`te_core.backends` entry point; nothing here touches the GPU at import time."""
