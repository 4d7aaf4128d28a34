"""semcomm.routing"""
