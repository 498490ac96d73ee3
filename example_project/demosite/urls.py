from django.contrib import admin
from django.urls import path
from uploads import views

urlpatterns = [
    path("", views.upload_list, name="upload_list"),
    path("admin/", admin.site.urls),
]
