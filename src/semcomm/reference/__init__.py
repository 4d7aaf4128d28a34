"""semcomm.reference"""
