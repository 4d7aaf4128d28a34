"""semcomm.integrations"""
