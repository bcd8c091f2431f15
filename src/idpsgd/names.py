"""The names the library accepts, defined once: IDP-SGD methods (Boenisch et al. 2023, §3) and
accountants.  Modules that check a name import the tuple from here instead of re-listing it."""

IDP_METHODS = ("uniform", "sample", "scale")
ACCOUNTANTS = ("rdp", "pld", "prv")
