"""autoplan.cli"""
