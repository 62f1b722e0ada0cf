"""The dashboard: the switchboard's business at a glance, at /ui on the switchboard's port.

store   the SQL of every page, on the switchboard's database (bounded, indexed)
fleet   what is asked of the butlers themselves (health, status, sessions, schedules, state)
auth    the token once, as a session cookie; CSRF tokens on forms
app     the pages (Jinja2 templates in templates/, style and refresh in static/)

Where this package sits among the others, and a message's path through them:
docs/architecture.md.
"""
