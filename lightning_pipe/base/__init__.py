"""The ground floor: what every layer above uses and which imports nothing of the package's own.

Errors, nested structures (`tree`), units, splitting a batch into microbatches and their weights, DTensor
helpers, the process's allocator and pages given back, and the aliases of modules that moved (`moved`).
"""
