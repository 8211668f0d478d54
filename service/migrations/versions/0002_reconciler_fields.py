"""What the reconciler keeps per job: its last summary, a submission not yet accepted by
Ray, since when it waits for resources, and since when a send to Ray is unanswered. Nullable or server-defaulted, so existing
rows upgrade in place.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("summary", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("summary_at", sa.Float(), nullable=True))
    op.add_column("jobs", sa.Column("pending_submission", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("jobs", sa.Column("waiting_since", sa.Float(), nullable=True))
    op.add_column("jobs", sa.Column("sending_since", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite drops columns only by copying the table
        for name in ("sending_since", "waiting_since", "pending_submission", "summary_at", "summary"):
            batch.drop_column(name)
