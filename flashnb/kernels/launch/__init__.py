"""Host launchers of the kernels: argument checks, tiles, launches."""
