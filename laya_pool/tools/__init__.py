"""The tools (`laya-pool make-checkpoint`, `bench`, `load`, ...): harnesses that may use every room.

No room imports them.
"""
