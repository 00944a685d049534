"""autoplan.estimate"""
