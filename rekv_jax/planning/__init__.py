"""The paper's cost model (Eqs. 8-12, Props. 1-2) and the planner built on it."""
