"""placeholder"""
def budget_problems(params):
    return []
