from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("rlplatform", "0003_scrape_token"),
    ]

    operations = [
        migrations.AddField(
            model_name="device",
            name="usage",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="The host agent's newest reading with its heartbeat: util_pct, mem_used_mb, at (ISO time)",
            ),
        ),
    ]
