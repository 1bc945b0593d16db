"""mok inside other libraries' models. Each integration is a module of its own, imported only by
those who use it (it imports its library):

    import mok.integrations.transformers   # registers experts_implementation="mok" (Hugging Face)
"""
