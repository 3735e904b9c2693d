"""The correctness core: sampling warps, chain and tree verification, and token trees.

Everything that decides which tokens a user gets lives here; a reviewer can audit this
package alone. Each module states its invariant and its proof in its docstring.
"""
