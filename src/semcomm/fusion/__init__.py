"""semcomm.fusion"""
