"""Pure algorithm functions: advantages (numpy) and policy losses (torch).

Everything here is a function of arrays: no configuration objects, no I/O, no distributed calls.
Stages and the trainer are the glue that feeds them.
"""
