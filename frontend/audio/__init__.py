"""The frontend's audio room: audio file bytes -> 16 kHz mono samples, and a transcription -> the
OpenAI response formats (json, text, srt, verbose_json, vtt)."""
