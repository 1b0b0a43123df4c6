"""Host launchers: a kernel's tiles fitted and checked, its arrays allocated, its grid launched, and the impl
registered (``flashnb.attention(..., impl=...)``)."""
