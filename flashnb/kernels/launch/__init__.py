"""Host launchers of the product kernels: what a call checks, the tiles it fits, the launches it makes."""
