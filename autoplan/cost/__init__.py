"""autoplan.cost"""
