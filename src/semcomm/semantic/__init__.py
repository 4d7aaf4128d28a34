"""semcomm.semantic"""
