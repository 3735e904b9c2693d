"""Measurement: every timing the engine takes of itself, in one place.

The builder times the target's passes (by their rows), a drafting step and the draft's
catch-up once, here, and hands the numbers to policy/ as one frozen Costs; policy decides
from numbers it is given and times nothing. The one live estimate (hybrid's c on padded
passes) is here too (measure/live.py).
"""
