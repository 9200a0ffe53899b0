"""The planner: placement under budgets, sizes, the step-time prediction and its report."""
